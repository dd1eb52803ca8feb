"""LoRA through TrainerWorker: checkpoints hold adapters and their optimizer state only, a resume continues the
uninterrupted run exactly, a LoRA checkpoint is refused by a full fine-tuning run, the exported PEFT adapter (and
the merged model) give the trainer's log-probs in transformers + peft, and `init_from` starts from it; with a KL
term the reference is the starting adapter (or the base) on the same model. On the MoE the push is the merged full
weights, and it leaves the base weights untouched.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg, with_old_logp
from conftest import hf_logprobs

LORA = {"rank": 4, "alpha": 8.0}


def _worker(port, model_dir, beta=0.0, **lora):
    from gspo_ray.trainer.worker import TrainerWorker

    cfg = trainer_cfg(1, lr=3e-2, lora=(LORA | lora) if lora is not None else None)
    return TrainerWorker(0, 1, "127.0.0.1", port, model_dir, cfg, algo_cfg(beta=beta))


def _scenario(rank, world_size, ports, model_dir, batch, root):
    from gspo_ray.trainer.lora.export import export_adapter_dir, merged_hf_state
    from gspo_ray.trainer.weights.bridge import write_hf_dir
    from gspo_ray.trainer.model_spec import read_hf_config

    out = {}
    w = _worker(ports[0], model_dir)
    out["base"] = w.compute_logprobs(batch, temperature=1.0)  # B = 0: the base model
    batch = with_old_logp(batch, w.compute_logprobs(batch))
    w.train_step(batch)
    w.save(root / "ckpt")
    out["after1"] = w.compute_logprobs(batch, temperature=1.0)
    w.train_step(batch)
    out["straight"] = w.compute_logprobs(batch)
    out["opt_params"] = sum(len(g["params"]) for o in w.optimizer.chained_optimizers for g in o.param_groups)
    out["lora_params"] = sum(1 for n, p in w.gpt.named_parameters() if p.requires_grad)
    w.shutdown()
    payload = torch.load(root / "ckpt" / "rank_0.pt", weights_only=True)
    out["ckpt_keys"] = sorted(payload["model"])

    w = _worker(ports[1], model_dir)  # resume: load, then the same second step
    w.load(root / "ckpt")
    w.train_step(batch)
    out["resumed"] = w.compute_logprobs(batch)
    w.shutdown()

    from gspo_ray.trainer.worker import TrainerWorker
    full = TrainerWorker(0, 1, "127.0.0.1", ports[2], model_dir, trainer_cfg(1), algo_cfg())
    try:
        full.load(root / "ckpt")
    except ValueError as e:
        out["full_ft_error"] = str(e)
    full.shutdown()

    export_adapter_dir(root / "ckpt", model_dir, root / "adapter")
    write_hf_dir(merged_hf_state(root / "ckpt", model_dir), read_hf_config(model_dir), model_dir, root / "merged")
    # with a KL term the reference is this model with the adapter it started from: no second model
    w = _worker(ports[3], model_dir, beta=0.1, init_from=str(root / "adapter"))
    out["init_from"] = w.compute_logprobs(batch, temperature=1.0)
    out["init_from_ref"] = w.compute_logprobs(batch, reference=True, temperature=1.0)
    out["ref_is_policy"] = w.ref_model is w.gpt
    on_policy = with_old_logp(dataclasses.replace(batch), out["init_from"])  # this run's own old log-probs
    out["kl_first"] = w.train_step(on_policy)["train/kl"]  # before the step's update
    out["moved"] = w.compute_logprobs(batch, temperature=1.0)
    out["init_from_ref_after"] = w.compute_logprobs(batch, reference=True, temperature=1.0)
    w.shutdown()
    w = _worker(ports[4], model_dir, beta=0.1)  # without init_from: the base, adapters bypassed
    w.load(root / "ckpt")
    out["bypassed_ref"] = w.compute_logprobs(batch, reference=True, temperature=1.0)
    out["trained"] = w.compute_logprobs(batch, temperature=1.0)
    w.shutdown()
    out["batch"] = batch
    return out


@pytest.fixture(scope="module")
def run(tiny_qwen2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ckpt")
    return run_ranks(_scenario, 1, (str(tiny_qwen2_dir), make_batch(8, vocab=23), root), n_ports=5)[0], root


def test_checkpoint_holds_adapters_only_and_resume_is_exact(run):
    out, _ = run
    assert out["ckpt_keys"] and all(".lora." in k for k in out["ckpt_keys"])
    assert out["opt_params"] == out["lora_params"] == len(out["ckpt_keys"])  # no base optimizer state
    assert (out["straight"] - out["after1"]).abs().max() > 1e-4  # the second step moved the policy
    assert torch.equal(out["resumed"], out["straight"])


def test_full_finetuning_run_refuses_a_lora_checkpoint(run):
    assert "a LoRA checkpoint (rank 4)" in run[0].get("full_ft_error", "")


def test_exported_adapter_loads_in_peft_and_init_from(run, tiny_qwen2_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, root = run
    batch = out["batch"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir)), str(root / "adapter"))
    with torch.no_grad():
        logsm = torch.log_softmax(model(input_ids=batch.tokens).logits.float()[:, :-1], -1)
    peft_logp = logsm.gather(-1, batch.tokens[:, 1:, None])[..., 0]
    valid = torch.arange(1, batch.tokens.shape[1])[None] < batch.lengths[:, None]
    assert (torch.where(valid, peft_logp - out["after1"][:, 1:], 0.0)).abs().max() < 1e-5
    merged, _ = hf_logprobs(root / "merged", batch.tokens, batch.lengths)
    assert (merged - out["after1"]).abs().max() < 1e-5
    assert (out["init_from"] - out["after1"]).abs().max() < 1e-6


def test_kl_reference_is_the_starting_adapter_without_a_second_model(run):
    """R11: with beta > 0 a LoRA run built a second full base model as the reference, which with init_from is
    not the policy the run started from. Now: the policy model itself, the init_from adapter swapped in (the KL
    at the first step, before any update, is 0), or every adapter bypassed (the base)."""
    out, _ = run
    assert out["ref_is_policy"]
    assert torch.equal(out["init_from_ref"], out["init_from"])
    assert abs(out["kl_first"]) < 1e-7, out["kl_first"]
    assert (out["moved"] - out["init_from"]).abs().max() > 1e-4  # the step moved the policy, not the reference
    assert torch.equal(out["init_from_ref_after"], out["init_from_ref"])
    assert (out["trained"] - out["base"]).abs().max() > 1e-4  # trained adapters, yet the reference is the base
    assert (out["bypassed_ref"] - out["base"]).abs().max() < 1e-6


def _merged_copies_per_bucket(w) -> dict:
    """R4: at each bucket the merged push yields, how many adapted linears' merged copies are alive: those that
    hold a merged tensor as their weight, plus merged tensors still referenced anywhere (the exporter's bucket keeps
    its own clones). Tiny buckets: nearly every tensor is a yield."""
    import gc
    import weakref

    from gspo_ray.trainer.lora import peft_io
    from gspo_ray.trainer.lora.adapters import adapted_linears

    linears = adapted_linears(w.gpt)
    originals = {id(linear): linear.weight.data_ptr() for _, linear in linears}
    made, merge = [], peft_io.merged_weight

    def tracked(weight, delta):
        out = merge(weight, delta)
        made.append(weakref.ref(out))
        return out

    counts = []
    peft_io.merged_weight = tracked
    try:
        for _ in w.lora.weights(w.gpt, w.spec, bucket_mb=1e-4):
            gc.collect()
            holding = sum(linear.weight.data_ptr() != originals[id(linear)] for _, linear in linears)
            counts.append(holding + sum(ref() is not None for ref in made))
    finally:
        peft_io.merged_weight = merge
    return {"max_alive": max(counts), "buckets": len(counts), "linears": len(linears), "merged": len(made)}


def _merged_push(rank, world_size, ports, model_dir, serve):
    from gspo_ray.trainer.lora.peft_io import export_adapter, load_full_adapter

    w = _worker(ports[0], model_dir, target_modules=["q_proj", "gate_proj", "down_proj"], serve=serve)
    g = torch.Generator().manual_seed(0)
    adapter = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in export_adapter(w.gpt, w.spec).items()}
    load_full_adapter(w.gpt, w.spec, adapter, "test")
    base_before = {n: p.detach().clone() for n, p in w.gpt.named_parameters() if ".lora." not in n}
    peak = _merged_copies_per_bucket(w)
    buckets = w.export_weights().buckets
    moved = max((p - base_before[n]).abs().max().item() for n, p in w.gpt.named_parameters() if n in base_before)
    batch = make_batch(4)
    logp = w.compute_logprobs(batch, temperature=1.0)
    w.shutdown()
    return {"state": {n: t for b in buckets for n, t in b}, "base_moved": moved, "logp": logp, "batch": batch,
            "peak": peak}


@pytest.mark.parametrize("model", ["moe", "dense_serve_merged"])
def test_push_is_the_merged_model(tiny_moe_dir, tiny_qwen2_dir, tmp_path, model):
    """An MoE always, a dense model with trainer.lora.serve merged: the push is W + scale B A, not the adapter."""
    from gspo_ray.trainer.weights.bridge import write_hf_dir
    from gspo_ray.trainer.model_spec import read_hf_config

    model_dir, serve = (tiny_moe_dir, "adapter") if model == "moe" else (tiny_qwen2_dir, "merged")
    out = run_ranks(_merged_push, 1, (str(model_dir), serve))[0]
    assert out["base_moved"] == 0.0  # the merge is on copies
    # R4: one adapted linear's merged copy alive at any yielded bucket, not one per adapted weight at once
    peak = out["peak"]
    assert peak["merged"] == peak["linears"] > 1 and peak["buckets"] > peak["linears"], peak
    assert peak["max_alive"] <= 1, peak
    full = ".experts.3.down_proj.weight" if model == "moe" else ".mlp.down_proj.weight"
    assert any(full in n for n in out["state"]) and not any("lora_" in n for n in out["state"])  # not adapters
    write_hf_dir(out["state"], read_hf_config(model_dir), model_dir, tmp_path / "merged")
    ref, _ = hf_logprobs(tmp_path / "merged", out["batch"].tokens, out["batch"].lengths)
    assert (ref - out["logp"]).abs().max() < 1e-4
    base, _ = hf_logprobs(model_dir, out["batch"].tokens, out["batch"].lengths)
    assert (base - out["logp"]).abs().max() > 1e-3  # the adapter moved the model: the push carries it
