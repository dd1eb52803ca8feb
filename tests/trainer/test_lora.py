"""LoRA on the Megatron trainer (gspo_ray/trainer/lora/adapters.py): exact at B = 0, gradients equal PEFT's,
TP/EP-invariant.

DeepSeek-V3's multi-latent attention and DeepSeekMoE's shared experts (deepseek_v3, glm4_moe) likewise, at TP 1
and TP 2 + SP in one spawn, with the merged weights' HF names and values.

One scenario per layout: build the tiny model, wrap it (rank 4, every target), load one fixed full adapter (A and
B random, so every gradient is non-zero), forward the batch, backward `-sum(logp)` and gather the adapter
gradients to full PEFT-named tensors. The golden is transformers + peft on the same model, adapter and batch.
"""
from __future__ import annotations

import types

import pytest
import torch

from _spawn import run_ranks
from conftest import random_batch

RANK, ALPHA = 4, 8.0


def _lora_cfg(**kw):
    from gspo_ray.config.lora import LoRAConfig

    return LoRAConfig(rank=RANK, alpha=ALPHA, **kw)


def _random_adapter(names_shapes: dict[str, tuple[int, ...]], seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: 0.2 * torch.randn(s, generator=g) for k, s in sorted(names_shapes.items())}


def _scenario(rank, world_size, ports, model_dir, tp, ep, tokens, lengths, adapter, targets, merged=False):
    """(base logp, logp at B = 0, adapter shapes) with adapter None; else (logp, full grads) under `adapter`, and
    with `merged` the HF state dict of the merged weights (what a merged push sends)."""
    from gspo_ray.trainer.logprobs import forward_logprobs
    from gspo_ray.trainer.lora.adapters import adapted_linears, adapter_hf_module, apply_lora, count_params
    from gspo_ray.trainer.lora.peft_io import export_adapter, gather_pair, load_full_adapter, peft_names
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "127.0.0.1", ports[0], tp=tp, ep=ep, seed=0)
    gpt, spec = build_model(model_dir)
    if ep > 1:  # data parallel too: each rank its own rows (experts then see every row exactly once)
        tokens, lengths = tokens[rank::world_size], lengths[rank::world_size]
    base = forward_logprobs(gpt, tokens, lengths).detach()
    apply_lora(gpt, spec, _lora_cfg(target_modules=targets))
    out = {}
    if adapter is None:
        out["base"] = base
        out["b0"] = forward_logprobs(gpt, tokens, lengths).detach()
        out["shapes"] = {k: tuple(v.shape) for k, v in export_adapter(gpt, spec).items()}
        out["trainable"] = [n for n, p in gpt.named_parameters() if p.requires_grad]
        out["counts"] = count_params(gpt)
    else:
        load_full_adapter(gpt, spec, adapter, "test adapter")
        logp = forward_logprobs(gpt, tokens, lengths)
        (-logp.sum()).backward()
        grads = {}
        for _, linear in adapted_linears(gpt):
            for target, pair in linear.lora.pairs.items():
                g = types.SimpleNamespace(A=pair.A.grad, B=pair.B.grad)
                a, b = gather_pair(g, linear.lora)
                names = peft_names(adapter_hf_module(linear.lora.target, target, spec))
                grads |= dict(zip(names, (a, b)))
        if tp > 1 and spec.is_moe:  # expert-TP 1: each TP rank's experts saw its own tokens (DDP sums them)
            from megatron.core import parallel_state as ps

            for k, v in grads.items():
                if ".mlp.experts." in k:
                    torch.distributed.all_reduce(v, group=ps.get_expert_data_parallel_group())
        if spec.ep > 1:  # dense grads: summed over the DP ranks' rows; experts: each on its EP rank, gather them
            for k, v in grads.items():
                if ".experts." not in k:
                    torch.distributed.all_reduce(v)
            gathered = [None] * world_size
            torch.distributed.all_gather_object(gathered, grads)
            grads = {k: v for d in gathered for k, v in d.items()}
        out["logp"], out["grads"] = logp.detach(), grads
        out["base_grads"] = [n for n, p in gpt.named_parameters() if p.grad is not None and ".lora." not in n]
        if merged:
            from gspo_ray.trainer.lora.peft_io import MergedParameters
            from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron

            out["merged"] = hf_state_dict_from_megatron(MergedParameters(gpt), spec)  # collective
            out["base_logp"] = base
    destroy_distributed()
    return out


def _peft_golden(model_dir, tokens, lengths, adapter, targets, plain_modules=False):
    """transformers + peft: logp [B, L] (aligned like forward_logprobs) and the adapter grads by PEFT name.

    plain_modules: every nn.Linear named like a target gets its adapter. PEFT 0.21 rewrites gate/up/down_proj on
    transformers 5's MoE models (glm4_moe, deepseek_v3 among them) into the fused experts' parameters and then
    adapts neither the dense layers' nor the shared experts' MLP; renaming the model_type skips that rewrite."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if plain_modules:
        model.config.model_type = "plain_modules"
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                                                   lora_dropout=0.0))
    res = set_peft_model_state_dict(peft_model, adapter)
    assert not res.unexpected_keys
    logits = peft_model(input_ids=tokens).logits.float()
    logsm = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    valid = torch.arange(1, tokens.shape[1])[None] < lengths[:, None]
    logp = torch.zeros(tokens.shape)
    logp[:, 1:] = torch.where(valid, logsm, 0.0)
    (-logp.sum()).backward()
    grads = {}
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            grads[name.replace(".default.weight", ".weight")] = p.grad
    return logp.detach(), grads


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def dense(tiny_qwen2_dir):
    tokens, lengths = random_batch(23, batch=3, length=11)
    args = (str(tiny_qwen2_dir), 1, 1, tokens, lengths)
    probe = run_ranks(_scenario, 1, args + (None, TARGETS))[0]
    adapter = _random_adapter(probe["shapes"])
    tp1 = run_ranks(_scenario, 1, args + (adapter, TARGETS))[0]
    return tokens, lengths, probe, adapter, tp1


def test_zero_b_is_exactly_the_base_and_only_adapters_train(dense):
    _, _, probe, _, tp1 = dense
    assert torch.equal(probe["b0"], probe["base"])  # B = 0 at init: bit-exact base log-probs
    assert probe["trainable"] and all(".lora." in n for n in probe["trainable"])
    trainable, total = probe["counts"]
    assert 0 < trainable < total
    assert tp1["base_grads"] == []  # no base weight got a gradient
    # adapters on every target of both layers: 7 targets x (A, B) x 2 layers
    assert len(probe["shapes"]) == 28


def test_adapter_grads_equal_peft_golden(dense, tiny_qwen2_dir):
    tokens, lengths, _, adapter, tp1 = dense
    logp, grads = _peft_golden(tiny_qwen2_dir, tokens, lengths, adapter, TARGETS)
    assert (tp1["logp"] - logp).abs().max() < 1e-5
    assert (tp1["logp"] - dense[2]["base"]).abs().max() > 1e-3  # the adapter changes the model
    assert set(grads) == set(tp1["grads"])
    for k, g in grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(tp1["grads"][k], g, rtol=1e-4, atol=1e-5, msg=k)


def test_tp2_equals_tp1(dense, tiny_qwen2_dir):
    tokens, lengths, _, adapter, tp1 = dense
    tp2 = run_ranks(_scenario, 2, (str(tiny_qwen2_dir), 2, 1, tokens, lengths, adapter, TARGETS))
    for r in tp2:
        assert (r["logp"] - tp1["logp"]).abs().max() < 1e-5
        for k, g in tp1["grads"].items():
            torch.testing.assert_close(r["grads"][k], g, rtol=1e-4, atol=1e-5, msg=k)


def test_ep2_expert_lora_equals_ep1(tiny_moe_dir):
    tokens, lengths = random_batch(22, batch=3, length=11)
    targets = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    args = (str(tiny_moe_dir), 1, 1, tokens, lengths)
    probe = run_ranks(_scenario, 1, args + (None, targets))[0]
    assert any(".experts.3.down_proj" in k for k in probe["shapes"])  # every expert adapted
    assert torch.equal(probe["b0"], probe["base"])
    adapter = _random_adapter(probe["shapes"])
    ep1 = run_ranks(_scenario, 1, args + (adapter, targets))[0]
    ep2 = run_ranks(_scenario, 2, (str(tiny_moe_dir), 1, 2, tokens, lengths, adapter, targets))
    for rank, r in enumerate(ep2):
        assert (r["logp"] - ep1["logp"][rank::2]).abs().max() < 1e-5
        assert set(r["grads"]) == set(ep1["grads"])
        for k, g in ep1["grads"].items():
            torch.testing.assert_close(r["grads"][k], g, rtol=1e-4, atol=1e-5, msg=k)


# ---- the DeepSeek-V3 / GLM-4.5 families: multi-latent attention and the shared experts ----------------------------
FAMILY_TARGETS = {
    "deepseek_v3": ["o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                    "kv_b_proj"],
    "glm4_moe": TARGETS,
}


def _families_scenario(rank, world_size, ports, cases, tokens, lengths):
    """Rank 0 runs every case at TP 1 in a world of its own, then both ranks at TP 2 + SP."""
    out = {"tp1": {}, "tp2": {}}
    for i, (arch, model_dir, adapter, targets) in enumerate(cases):
        if rank == 0:
            out["tp1"][arch] = _scenario(0, 1, ports[i:i + 1], model_dir, 1, 1, tokens, lengths, adapter, targets,
                                         merged=True)
    for i, (arch, model_dir, adapter, targets) in enumerate(cases):
        j = len(cases) + i
        out["tp2"][arch] = _scenario(rank, world_size, ports[j:j + 1], model_dir, 2, 1, tokens, lengths, adapter,
                                     targets, merged=True)
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Tiny deepseek_v3 (q_lora_rank 32, kv_lora_rank 32, a dense layer then an MoE layer with a shared expert) and
    glm4_moe; one random full adapter each (shapes: the preflight's expected_adapter_shapes), the routed experts' B
    zero (transformers 5 fuses experts into one parameter, which PEFT cannot target: the golden has no adapter
    there; their LoRA is test_ep2_expert_lora_equals_ep1's)."""
    from gspo_ray.models.tiny import ensure_tiny_model
    from gspo_ray.models.tiny_deepseek import make_tiny_deepseek_v3
    from gspo_ray.trainer.lora.peft_io import expected_adapter_shapes
    from gspo_ray.trainer.model_spec import read_hf_config, spec_from_hf_config

    root = tmp_path_factory.mktemp("lora_families")
    dirs = {"deepseek_v3": str(make_tiny_deepseek_v3(root / "ds", seed=0, init_std=0.02, kv_lora_rank=32,
                                                     qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)),
            "glm4_moe": str(ensure_tiny_model("glm4_moe", root / "glm", seed=0))}
    tokens, lengths = random_batch(22, batch=3, length=11)
    cases, adapters = [], {}
    for arch, model_dir in dirs.items():
        spec = spec_from_hf_config(read_hf_config(model_dir), model_dir)
        shapes = expected_adapter_shapes(spec, RANK, FAMILY_TARGETS[arch])
        adapter = _random_adapter(shapes)
        for k in adapter:
            if ".mlp.experts." in k and ".lora_B." in k:
                adapter[k].zero_()
        adapters[arch] = adapter
        cases.append((arch, model_dir, adapter, FAMILY_TARGETS[arch]))
    ranks = run_ranks(_families_scenario, 2, (cases, tokens, lengths), n_ports=2 * len(cases))
    return {"dirs": dirs, "tokens": tokens, "lengths": lengths, "adapters": adapters, "ranks": ranks}


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mla_and_shared_expert_adapters_equal_peft_at_tp1_and_tp2(families, arch):
    """Adapters on every multi-latent attention projection (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
    o_proj) and on the shared experts: log-probs and every adapter gradient equal transformers + peft loaded with
    the same PEFT-named tensors (names right, gradients non-zero), at TP 1 and at TP 2 + SP (column-parallel
    q_a / q_b / kv_b, the replicated kv_a whose factors' gradients are summed over TP, row-parallel o_proj)."""
    model_dir, adapter, targets = families["dirs"][arch], families["adapters"][arch], FAMILY_TARGETS[arch]
    golden_adapter = {k: v for k, v in adapter.items() if ".mlp.experts." not in k}
    logp, grads = _peft_golden(model_dir, families["tokens"], families["lengths"], golden_adapter, targets,
                               plain_modules=True)
    tp1 = families["ranks"][0]["tp1"][arch]
    assert (tp1["logp"] - logp).abs().max() < 1e-5
    assert (tp1["logp"] - tp1["base_logp"]).abs().max() > 1e-3  # the adapter changes the model
    assert set(grads) == set(golden_adapter) and set(tp1["grads"]) == set(adapter)
    new = ["shared_experts.gate_proj", "shared_experts.down_proj"] + (
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "self_attn.o_proj"] if arch == "deepseek_v3"
        else [])
    for part in new:
        assert any(f".{part}.lora_A." in k for k in grads), part
    for k, g in grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(tp1["grads"][k], g, rtol=1e-4, atol=1e-5, msg=k)
    for rank, r in enumerate(families["ranks"]):
        tp2 = r["tp2"][arch]
        assert (tp2["logp"] - tp1["logp"]).abs().max() < 1e-5, rank
        for k, g in tp1["grads"].items():
            torch.testing.assert_close(tp2["grads"][k], g, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_merged_mla_and_shared_expert_weights_are_base_plus_scaled_b_a_under_hf_names(families, arch):
    """The merged push (TP 1 and TP 2 + SP, gathered): each adapted HF weight is W + (alpha / r) B A, every other
    tensor the input's bit for bit, the names the checkpoint's."""
    from safetensors.torch import load_file

    base = load_file(f"{families['dirs'][arch]}/model.safetensors")
    adapter = families["adapters"][arch]
    adapted = {}
    for a_name in (n for n in adapter if n.endswith(".lora_A.weight")):
        module = a_name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = adapter[a_name.replace(".lora_A.", ".lora_B.")]
        adapted[module + ".weight"] = (ALPHA / RANK) * b @ adapter[a_name]
    must = {"model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    if arch == "deepseek_v3":
        must |= {f"model.layers.0.self_attn.{p}.weight" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                   "kv_b_proj", "o_proj")}
    assert must <= set(adapted), sorted(must - set(adapted))
    ranks = families["ranks"]
    for layout, merged in [("tp1", ranks[0]["tp1"][arch]["merged"])] + [
            (f"tp2 rank {i}", r["tp2"][arch]["merged"]) for i, r in enumerate(ranks)]:
        assert set(merged) == set(base), (layout, sorted(set(merged) ^ set(base)))
        for name, w in base.items():
            if name in adapted:
                torch.testing.assert_close(merged[name], w + adapted[name], rtol=0, atol=1e-6, msg=(layout, name))
                assert adapted[name].abs().max() == 0 or not torch.equal(merged[name], w), (layout, name)
            else:
                assert torch.equal(merged[name], w), (layout, name)
