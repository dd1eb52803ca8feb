"""vllm_cpu_lora: vLLM's CPU LoRA ops still copy the adapter per token, and the one-product ops equal them.

This test FAILS
  * when the workaround stops being needed: vLLM's `bgmv_*` ops no longer gather the stacked adapter weights by
    the per-token slot indices (the [T, out, in] copy the profiler shows as `aten::index` of the weights);
  * when it stops being correct: the patched ops differ from vLLM's on one slot (shrink, expand with and without
    accumulation and with a padded output, expand into a slice), do not fall back exactly on mixed slots, or the
    prefill (`sgmv_*`) ops do not reach them.
"""
from __future__ import annotations

import pytest
import torch

from gspo_ray.compat import vllm_cpu_lora
from gspo_ray.compat.vllm_cpu_lora import apply_lora_fix, needs_lora_fix, original_op

T, IN, RANK, OUT, SLOTS = 24, 40, 8, 56, 2


@pytest.fixture(scope="module")
def ops():
    assert needs_lora_fix(), "vLLM's version or platform changed: re-measure whether the workaround is needed"
    assert apply_lora_fix()
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):  # bound where the CPU wrapper looks
        assert getattr(punica_cpu, name) is getattr(vllm_cpu_lora, name)
        assert getattr(lora_ops, name) is getattr(vllm_cpu_lora, name)
    return lora_ops


def _case(seed: int, unit_dim: bool = True):
    g = torch.Generator().manual_seed(seed)
    shape_a = (SLOTS, 1, RANK, IN) if unit_dim else (SLOTS, RANK, IN)
    shape_b = (SLOTS, 1, OUT, RANK) if unit_dim else (SLOTS, OUT, RANK)
    return (torch.randn(T, IN, generator=g), torch.randn(*shape_a, generator=g),
            torch.randn(*shape_b, generator=g), torch.randn(T, RANK, generator=g))


def _indices(uniform: bool) -> torch.Tensor:
    return torch.ones(T, dtype=torch.long) if uniform else torch.arange(T) % SLOTS


def test_vllm_ops_still_copy_the_adapter_per_token(ops):
    x, a, _, _ = _case(0)
    out = torch.zeros(T, RANK)
    with torch.profiler.profile(record_shapes=True) as prof:
        original_op("bgmv_shrink")(x, a, out, _indices(True), 0.5)
    gathers = [e for e in prof.events() if e.name == "aten::index" and e.input_shapes
               and list(e.input_shapes[0]) == list(a.shape)]
    assert gathers, "vLLM's bgmv_shrink no longer indexes the stacked weights per token: drop vllm_cpu_lora"
    with torch.profiler.profile(record_shapes=True) as prof:
        vllm_cpu_lora.bgmv_shrink(x, a, torch.zeros(T, RANK), _indices(True), 0.5)
    assert not [e for e in prof.events() if e.name == "aten::index" and e.input_shapes
                and list(e.input_shapes[0]) == list(a.shape) and list(e.input_shapes[1] or []) == [T]]


@pytest.mark.parametrize("unit_dim", [True, False])
@pytest.mark.parametrize("uniform", [True, False])
def test_the_one_product_ops_equal_vllms(ops, uniform, unit_dim):
    x, a, b, h = _case(1, unit_dim)
    idx = _indices(uniform)
    exact = {} if uniform else {"rtol": 0, "atol": 0}  # mixed slots: vLLM's own function, so bit-equal
    tol = exact or {"rtol": 1e-5, "atol": 1e-5}

    got, want = torch.zeros(T, RANK), torch.zeros(T, RANK)
    vllm_cpu_lora.bgmv_shrink(x, a, got, idx, 0.5)
    original_op("bgmv_shrink")(x, a, want, idx, 0.5)
    torch.testing.assert_close(got, want, **tol)

    for add_inputs in (True, False):
        base = torch.randn(T, OUT + 8)  # the model pads its output wider than the adapter's
        got, want = base.clone(), base.clone()
        vllm_cpu_lora.bgmv_expand(h, b, got, idx, add_inputs)
        original_op("bgmv_expand")(h, b, want, idx, add_inputs)
        torch.testing.assert_close(got, want, **tol)

        base = torch.randn(T, 3 * OUT)  # one slice of a merged (qkv / gate-up) output
        got, want = base.clone(), base.clone()
        vllm_cpu_lora.bgmv_expand_slice(h, b, got, idx, OUT, OUT, add_inputs)
        original_op("bgmv_expand_slice")(h, b, want, idx, OUT, OUT, add_inputs)
        torch.testing.assert_close(got, want, **tol)


def test_prefill_ops_reach_the_one_product_path(ops):
    x, a, _, _ = _case(2)
    seq_lens = torch.tensor([10, 14])
    starts = torch.tensor([0, 10])
    got = torch.zeros(T, RANK)
    ops.sgmv_shrink(x, a, got, starts, seq_lens, torch.tensor([1, 1]), 2, 14, T, 0.25)
    want = torch.zeros(T, RANK)
    original_op("bgmv_shrink")(x, a, want, torch.ones(T, dtype=torch.long), 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.profiler.profile(record_shapes=True) as prof:
        ops.sgmv_shrink(x, a, torch.zeros(T, RANK), starts, seq_lens, torch.tensor([1, 1]), 2, 14, T, 0.25)
    assert not [e for e in prof.events() if e.name == "aten::einsum"], "sgmv_shrink bypassed the patched bgmv"
