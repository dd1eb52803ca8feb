"""LoRA on the Megatron trainer (gspo_ray/trainer/lora/adapters.py): exact at B = 0, gradients equal PEFT's,
TP/EP-invariant.

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


def _scenario(rank, world_size, ports, model_dir, tp, ep, tokens, lengths, adapter, targets):
    """(base logp, logp at B = 0, adapter shapes) with adapter None; else (logp, full grads) under `adapter`."""
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
        if spec.ep > 1:  # dense grads: summed over the DP ranks' rows; experts: each on its EP rank, gather them
            for k, v in grads.items():
                if ".experts." not in k:
                    torch.distributed.all_reduce(v)
            gathered = [None] * world_size
            torch.distributed.all_gather_object(gathered, grads)
            grads = {k: v for d in gathered for k, v in d.items()}
        out["logp"], out["grads"] = logp.detach(), grads
        out["base_grads"] = [n for n, p in gpt.named_parameters() if p.grad is not None and ".lora." not in n]
    destroy_distributed()
    return out


def _peft_golden(model_dir, tokens, lengths, adapter, targets):
    """transformers + peft: logp [B, L] (aligned like forward_logprobs) and the adapter grads by PEFT name."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
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
