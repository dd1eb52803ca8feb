"""ParallelLoRA.add_to's one-product path (TP 1 / experts, fp32: every target of a fused linear in one pair of
matmuls) against the per-target path out + lora(x): output and every gradient, for each layout (qkv interleaved
per query group, gated, a single target) and subsets of a fused linear's targets; B = 0 adds exactly nothing."""
import dataclasses

import pytest
import torch
from torch import nn

from gspo_ray.config.lora import LoRAConfig
from gspo_ray.trainer.lora.adapters import ParallelLoRA, match_linear
from gspo_ray.trainer.model_spec import ModelSpec

SPEC = ModelSpec(arch="test", hf_config={}, hf_dir="", vocab_size=10, padded_vocab_size=10, num_layers=1,
                 hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=6, ffn_hidden_size=40)
LAYER = "decoder.layers.0."
CASES = [  # (module, targets, in, out)
    ("self_attention.linear_qkv", ["q_proj", "k_proj", "v_proj"], 24, 48),
    ("self_attention.linear_qkv", ["q_proj", "v_proj"], 24, 48),
    ("self_attention.linear_qkv", ["k_proj"], 24, 48),
    ("mlp.linear_fc1", ["gate_proj", "up_proj"], 24, 80),
    ("mlp.linear_fc1", ["up_proj"], 24, 80),
    ("mlp.linear_fc2", ["down_proj"], 40, 24),
    ("self_attention.linear_proj", ["o_proj"], 24, 24),
]


def _lora(module: str, targets: list[str], seed: int = 0) -> ParallelLoRA:
    lora = ParallelLoRA(match_linear(LAYER + module, targets), SPEC,
                        LoRAConfig(rank=4, alpha=8, target_modules=targets), nn.Linear(1, 1))
    g = torch.Generator().manual_seed(seed)
    for p in lora.parameters():
        p.data = torch.randn(p.shape, generator=g) / 4
    return lora


@pytest.mark.parametrize("module,targets,n_in,n_out", CASES)
def test_one_product_path_equals_per_target_path(module, targets, n_in, n_out):
    lora = _lora(module, targets)
    assert lora.local
    torch.manual_seed(1)
    x = torch.randn(5, 2, n_in).requires_grad_()
    out = torch.randn(5, 2, n_out).requires_grad_()
    fast, ref = lora.add_to(out, x), out + lora(x)
    grad = torch.randn_like(ref)
    wrt = [x, out, *lora.parameters()]
    for a, b in zip((fast, *torch.autograd.grad(fast, wrt, grad)), (ref, *torch.autograd.grad(ref, wrt, grad))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fp32, summation order differs


@pytest.mark.parametrize("module,targets,n_in,n_out", CASES[:1] + CASES[3:4])
def test_zero_b_adds_exactly_nothing(module, targets, n_in, n_out):
    lora = _lora(module, targets)
    for pair in lora.pairs.values():
        pair.B.data.zero_()
    out = torch.randn(7, n_out)
    assert torch.equal(lora.add_to(out, torch.randn(7, n_in)), out)


def test_non_fp32_input_takes_the_per_target_path():
    lora = _lora(*CASES[0][:2])
    x, out = torch.randn(3, 24, dtype=torch.bfloat16), torch.randn(3, 48, dtype=torch.bfloat16)
    fast = lora.add_to(out, x)
    assert fast.dtype == torch.bfloat16
    assert torch.equal(fast, out + lora(x))


class _Linear(nn.Module):
    """A Megatron linear's parameter as apply_lora sees it, on `device`."""

    def __init__(self, n_in: int, n_out: int, device: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, device=device))


def test_adapters_are_created_on_their_base_weights_device():
    """R1: a model on CUDA got fp32 adapters on the CPU (Megatron's bf16 optimizer refuses them; the first forward
    mixes devices). The meta device stands in for CUDA on this CPU machine: each adapter follows its base, the
    full adapter's init is copied onto it, and the other linears keep theirs on the CPU."""
    from gspo_ray.trainer.lora.adapters import adapted_linears, apply_lora

    spec = dataclasses.replace(SPEC, arch="llama")  # HF names for the adapters' init seeds
    layer = nn.Module()
    layer.self_attention, layer.mlp = nn.Module(), nn.Module()
    layer.self_attention.linear_qkv = _Linear(24, 48, "meta")
    layer.self_attention.linear_proj = _Linear(24, 24, "cpu")
    layer.mlp.linear_fc1 = _Linear(24, 80, "meta")
    layer.mlp.linear_fc2 = _Linear(40, 24, "cpu")
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList([layer])
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    done = apply_lora(model, spec, LoRAConfig(rank=4, alpha=8, target_modules=targets))
    assert len(done) == 4
    for _, linear in adapted_linears(model):
        for pair in linear.lora.pairs.values():
            for p in (pair.A, pair.B):
                assert p.device == linear.weight.device and p.dtype == torch.float32, (linear, p.device)
    assert {str(p.device) for p in model.parameters() if p.requires_grad} == {"cpu", "meta"}


def test_a_tensor_parallel_linear_without_sequence_parallelism_is_refused():
    """At TP > 1 the adapters are written for sequence parallelism only (build_model's default there)."""
    base = nn.Linear(1, 1)
    base.tp_group = type("Group", (), {"size": lambda self: 2})()
    t = match_linear(LAYER + CASES[0][0], CASES[0][1])
    with pytest.raises(ValueError, match="LoRA at TP 2 needs sequence parallelism"):
        ParallelLoRA(t, SPEC, LoRAConfig(rank=4, alpha=8, target_modules=CASES[0][1]), base)
    base.sequence_parallel = True
    assert ParallelLoRA(t, SPEC, LoRAConfig(rank=4, alpha=8, target_modules=CASES[0][1]), base).sequence_parallel
