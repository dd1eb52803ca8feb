"""LoRA on Transformer Engine's linears (trainer/lora/adapters.py: LINEAR_CLASSES, the fused-norm input, grouped
experts), checked on CPU.

Transformer Engine cannot be imported here (no CUDA), so its classes are STAND-INS defined below: same class names
(what the registry matches), same attributes and forward return convention as megatron-core 0.16.1's wrappers
(extensions/transformer_engine.py) over TE's LayerNormLinear / GroupedLinear: `weight` + `layer_norm_weight` +
`eps` + `normalization`, forward(x) -> (RMSNorm(x) W^T, None); `num_gemms` + `weight{j}`, forward(x, m_splits) ->
(rows of expert j times W_j^T, None). They test our wrapping logic, not TE's kernels. The local linears are the
real Megatron ones, in one spawned process beside the stand-ins.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from _spawn import run_ranks

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TELayerNormColumnParallelLinear(nn.Module):
    """Stand-in for megatron-core's TELayerNormColumnParallelLinear (TE not importable here; see the module doc)."""

    def __init__(self, n_in: int, n_out: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.layer_norm_weight = nn.Parameter(1 + torch.randn(n_in) / 4)
        self.eps, self.normalization, self.zero_centered_gamma = eps, "RMSNorm", False

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps) @ self.weight.t(), None


class _GroupedStandIn(nn.Module):
    def __init__(self, num_gemms: int, n_in: int, n_out: int):
        super().__init__()
        self.num_gemms = num_gemms
        for j in range(num_gemms):
            self.register_parameter(f"weight{j}", nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5))

    def forward(self, x, m_splits):
        parts = [xi @ getattr(self, f"weight{j}").t() for j, xi in enumerate(x.split(list(m_splits)))]
        return torch.cat(parts), None


class TEColumnParallelGroupedLinear(_GroupedStandIn):
    """Stand-in for megatron-core's TEColumnParallelGroupedLinear (TE not importable here; see the module doc)."""


class TERowParallelGroupedLinear(_GroupedStandIn):
    """Stand-in for megatron-core's TERowParallelGroupedLinear (TE not importable here; see the module doc)."""


def _tree(spec, grouped: bool) -> nn.Module:
    """decoder.layers.{i}: self_attention.linear_qkv (the fused-norm stand-in) and, with grouped, the grouped expert
    stand-ins at mlp.experts.linear_fc1 / linear_fc2 (TEGroupedMLP's names)."""
    root, root.decoder = nn.Module(), nn.Module()
    layers = []
    for _ in range(spec.num_layers):
        layer = nn.Module()
        layer.self_attention = nn.Module()
        qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        layer.self_attention.linear_qkv = TELayerNormColumnParallelLinear(spec.hidden_size, qkv_out)
        if grouped:
            layer.mlp, layer.mlp.experts = nn.Module(), nn.Module()
            f, e = spec.moe_ffn_hidden_size, spec.num_local_experts
            layer.mlp.experts.linear_fc1 = TEColumnParallelGroupedLinear(e, spec.hidden_size, 2 * f)
            layer.mlp.experts.linear_fc2 = TERowParallelGroupedLinear(e, f, spec.hidden_size)
        layers.append(layer)
    root.decoder.layers = nn.ModuleList(layers)
    return root


def _randomise_b(model):
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if name.endswith(".B"):
            p.data = torch.randn(p.shape, generator=g) / 4


def _scenario(rank, world_size, ports, hf_dir):
    from gspo_ray.config.lora import LoRAConfig
    from gspo_ray.trainer.weights.bridge import is_lora_param
    from gspo_ray.trainer.lora.adapters import (GroupedExpertView, adapted_linears, apply_lora,
                                                 linear_kind, reference_adapters)
    from gspo_ray.trainer.lora.peft_io import MergedParameters
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(0, 1, "127.0.0.1", ports[0])
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=TARGETS)
    out = {}
    # the real local model: its linears' kinds, and the names / init of SequentialMLP's expert adapters
    local, spec = build_model(str(hf_dir))
    layer = local.decoder.layers[0]
    out["local_kinds"] = [linear_kind(m) for m in (layer.self_attention.linear_qkv, layer.self_attention.linear_proj,
                                                   layer.mlp.experts.local_experts[0].linear_fc1,
                                                   layer.mlp.experts.local_experts[0].linear_fc2)]
    apply_lora(local, spec, cfg, seed=3)
    local_state = {k: v.clone() for k, v in local.state_dict().items() if is_lora_param(k)}

    torch.manual_seed(0)
    model = _tree(spec, grouped=True)
    apply_lora(model, spec, cfg, seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items() if is_lora_param(k)}
    out["same_names_and_init"] = sorted(state) == sorted(k for k in local_state if ".mlp." in k
                                                         or ".linear_qkv." in k) and all(
        torch.equal(v, local_state[k]) for k, v in state.items())
    out["views"] = [n for n, m in adapted_linears(model) if isinstance(m, GroupedExpertView)][:2]
    _randomise_b(model)

    # the fused-norm linear: out = norm(x) (W + dW)^T, the gradient to x through the norm as well
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(6, 2, spec.hidden_size, requires_grad=True)
    got = qkv(x)[0]
    normed = F.rms_norm(x, (spec.hidden_size,), qkv.layer_norm_weight, qkv.eps)
    want = normed @ (qkv.weight + qkv.lora.delta_weight()).t()
    grad = torch.randn_like(want)
    out["norm_out_diff"] = float((got - want).abs().max())
    out["norm_grad_diff"] = float((torch.autograd.grad(got, x, grad)[0] - torch.autograd.grad(want, x, grad)[0])
                                  .abs().max())

    # grouped experts: each expert's rows get its own adapter (an expert with no token included)
    experts = model.decoder.layers[0].mlp.experts
    splits = [3, 0, 5, 2]
    h = torch.randn(sum(splits), spec.hidden_size)
    got = experts.linear_fc1(h, splits)[0]
    want = torch.cat([hj @ (getattr(experts.linear_fc1, f"weight{j}") + experts.local_experts[j].linear_fc1.lora
                            .delta_weight()).t() for j, hj in enumerate(h.split(splits))])
    out["grouped_diff"] = float((got - want).abs().max())
    base = experts.linear_fc2.weight1.detach().clone()
    delta = experts.local_experts[1].linear_fc2.lora.delta_weight()
    # merged pushes read weight{j} through the view
    merged = dict(MergedParameters(model).named_parameters())
    name = next(n for n, p in model.named_parameters() if p is experts.linear_fc2.weight1)
    out["merged_diff"] = float((merged[name] - (base + delta)).abs().max())
    out["restored"] = torch.equal(experts.linear_fc2.weight1, base)
    y = torch.randn(sum(splits), spec.moe_ffn_hidden_size)
    plain = torch.cat([yj @ getattr(experts.linear_fc2, f"weight{j}").t() for j, yj in enumerate(y.split(splits))])
    with reference_adapters(model):  # the reference policy's forward: every view's adapter bypassed
        out["bypass_diff"] = float((experts.linear_fc2(y, splits)[0] - plain).abs().max())
    out["adapted_moved"] = float((experts.linear_fc2(y, splits)[0] - plain).abs().max())

    # attention targets only: the grouped linears get no views and no hook
    attn_only = _tree(spec, grouped=True)
    apply_lora(attn_only, spec, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj"]))
    out["attn_only_experts"] = sorted(n for n, _ in attn_only.decoder.layers[0].mlp.experts.named_children())

    # a known linear class whose partitioning is not the one its place needs is refused by name
    bad = _tree(spec, grouped=False)
    bad.decoder.layers[0].self_attention.linear_proj = TELayerNormColumnParallelLinear(spec.hidden_size,
                                                                                       spec.hidden_size)
    try:
        apply_lora(bad, spec, cfg)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    destroy_distributed()
    return out


def test_lora_on_transformer_engine_linears(tiny_moe_dir):
    from gspo_ray.trainer.lora.adapters import LinearKind

    (r,) = run_ranks(_scenario, 1, (tiny_moe_dir,))
    assert r["local_kinds"] == [LinearKind("col"), LinearKind("row"), LinearKind("col"), LinearKind("row")]
    assert r["same_names_and_init"]  # grouped experts' adapters are SequentialMLP's, name for name, value for value
    assert r["views"] == ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1",
                          "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2"]
    assert r["norm_out_diff"] < 1e-5 and r["norm_grad_diff"] < 1e-5
    assert r["grouped_diff"] < 1e-5
    assert r["merged_diff"] < 1e-6 and r["restored"]
    assert r["attn_only_experts"] == ["linear_fc1", "linear_fc2"]
    assert r["bypass_diff"] == 0 and r["adapted_moved"] > 1e-3
    assert r["refused"] and "linear_proj is a TELayerNormColumnParallelLinear" in r["refused"]
